"""Pure-torch cores: packed boundaries, position ids, the forward context, varlen and linear attention, the
Ulysses exchange. Imports neither transformers nor the registry."""
