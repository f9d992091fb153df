"""kvguard.workers: the tagged disaggregated inference engine. Never imports kvguard.operator."""
