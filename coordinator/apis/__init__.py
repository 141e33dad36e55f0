"""Client API adapters: parse and validate, map to a GenerationRequest, format events back."""
