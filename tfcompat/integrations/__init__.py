"""Entry points with the calling conventions of the trainers tfcompat's users already run.

- `tfcompat.integrations.verl`: ``apply_monkey_patch``, what verl's FSDP workers call on a freshly built model.

Nothing here is imported by ``import tfcompat``, and no trainer is imported by importing these modules: each
reads its trainer's state lazily, when a patched model runs.
"""

__all__: list[str] = []
