"""Integrations with tools around training: progress lines, W&B, reward-curve plots (matplotlib), and what a run
reports about the machine (`machine`)."""
