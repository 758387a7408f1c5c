"""zbuf: ZeRO-3 training for torch.compile."""
