"""comlrl_trl: cooperative multi-agent reinforcement learning for LLMs, built on Hugging Face TRL."""

__version__ = "0.1.0"
