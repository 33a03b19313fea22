"""The shared base of the ranked backends (DDP, FSDP2, tensor and pipeline parallel), for use inside dpverify."""
