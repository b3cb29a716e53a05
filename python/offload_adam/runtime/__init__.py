"""The offload runtime, which knows nothing of optimizers, weights or activations: one device per
torch device (``device.py``: CUDA, or the simulator tests install), exact-size pinned memory
(``pinned.py``), run directories and paging to files (``pager.py``), the module schedule
(``schedule.py``), the homes of streamed weights (``hosted.py``), safetensors files
(``safetensors.py``), this machine's measured figures (``calibration.py``) and the argument
checks the clients share (``checks.py``)."""
