"""Integrations with tools around training: progress lines, W&B, reward-curve plots (matplotlib)."""
