"""What both ends compute with: a model's state and the one step that changes it.

A shard (``psserver``) and the in-process ``local`` client (``psworker.local``) hold their
variables, optimizer slots and table rows in ``pscore.variables.Variables`` and apply every
step through its ``apply``, so ``local`` is the reference by construction, not by copy.
"""
