"""The optimizer (``offload_adam.AdamW``/``Adam``): torch's public surface (``optimizer.py``), the
state schema (``schema.py``: the moments declared once), a group's layout and buffers
(``state.py``), where the state lives between steps (``tier.py``: RAM or NVMe), the gradients of
offloaded groups (``grads.py``), the step (``engine.py``), the streaming checkpoint format
(``checkpoint.py``) and the DDP hook (``ddp.py``)."""
