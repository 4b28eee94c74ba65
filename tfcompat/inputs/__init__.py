"""What a patched forward is fed: `pack`, `rope_index`, `embed_inputs` and the checks on vision inputs."""
