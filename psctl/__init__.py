"""The operator's tool: launch a local cluster, train the demo, status, checkpoint/export, certs."""
