"""Ready-made models: the demo model (`comlrl_trl.models.demo`, SmolLM2-135M-Instruct converted from a wheel)."""
