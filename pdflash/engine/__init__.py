"""The DFlash serving engine: drafter, paged KV, batched verify, sessions."""
