"""The patch of a transformers model: what `patch()` changes (`patching`) and what the patched forward does
(`forward`, `attention`, `linear_attention`)."""
