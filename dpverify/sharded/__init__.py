"""Sharded and model parallelism on real torch.distributed ranks: FSDP2 (``fully_shard``),
tensor parallelism (``parallelize_module`` over DTensor) and pipeline parallelism
(``torch.distributed.pipelining``), each checked against the single-device step.

The checks run on the same pooled ranks as the DDP checks (``dpverify.ddp.pool``): a task
builds its device mesh from the ranks' default process group (``mesh.device_mesh``, cached
per rank process), so no check starts a process group of its own.
"""
