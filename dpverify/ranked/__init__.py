"""The shared base of the ranked backends (DDP, FSDP2, tensor parallel, pipeline), for use
inside dpverify: what a check's rank processes run in common, and what the checks that
send them tasks share. The backends in ``dpverify.ddp`` and ``dpverify.sharded`` build on it.
"""
