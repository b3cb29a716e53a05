"""The optimizer (``offload_adam.AdamW``/``Adam``), in rooms that depend downward only:

- ``optimizer.py``: torch's public surface, kept to bookkeeping as torch's ``Adam`` is; its state
  import and export are the plain functions of ``state_io.py`` (``state_dict``, loads, the
  take-over of state written by others, streaming checkpoints, copies), handed what they need;
- ``ddp.py``: the DDP communication hook, over the engine's public streamed gradients;
- ``engine.py``: the step (CPU groups in one native call, offloaded groups bucket by bucket);
- ``waits.py``: async mode's forward waits, a subscriber of the module schedule;
- ``grads.py``: the offloaded gradients' trip (hook, landing slot) and each ``Bucket``'s fences,
  which only this file writes (the engine and the forward waits call its methods); the norm;
- ``state.py`` (a group's layout, buffers and one ``Slot`` per parameter), ``tier.py`` (RAM or
  NVMe), ``schema.py`` (the moments declared once), ``shards.py`` (DTensor shards),
  ``hyper.py`` (the hyper-parameters' checks) and ``checkpoint.py`` (the streaming format).
"""
