"""Training the drafters on the target's own behaviour (self-distillation)."""
