"""kvguard.operator.canary: the canary coherence suite."""
