"""Integrations of pdflash's offloaded experts with other libraries
(:mod:`pdflash.integrations.transformers`)."""
