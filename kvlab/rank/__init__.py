"""The runtime of one rank: the control plane and handshake (``control``), the rank's run from start
to part file (``runner``), the event-driven transfer loop (``executor``), the prefill beside it
(``prefiller``, ``prefill_gpu``), the reports to rank 0 (``report``, ``progress``), the link reference
(``linkrate``, ``linkcurve``), the decode check with a real model (``decode_check``, ``hf_models``) and
wandb (``wandb_sink``). Imports kvlab.sizing and every layer below it."""
