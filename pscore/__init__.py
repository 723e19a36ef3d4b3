"""What both ends compute with: a model's state and the one step that changes it.

A shard (``psserver``) and the in-process ``local`` client (``psworker.local``) hold their
variables, optimizer slots and table rows in ``pscore.variables.Variables`` and apply every
step through its ``apply``, so ``local`` is the reference by construction, not by copy.

Also here: the job description (``job``), tensor checks (``checks``), the optimizers' math
(``optim``, ``optspec``), embedding tables (``tables``) and their row store (``rowstore``,
``rowindex``). pscore imports numpy and ``pswire.errors`` only (the exception family both ends
raise); the wire forms of these types are ``pswire``'s, which imports pscore, never the reverse.
"""
