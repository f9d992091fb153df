"""kvguard: safe rollouts of LLM inference, and the tagged prefill/decode engine they manage."""

__version__ = "0.1.0"
