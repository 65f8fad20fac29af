"""Pure, model-free building blocks (joint actions, advantages)."""
