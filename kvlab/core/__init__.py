"""The ground floor: what every other layer may use and that imports nothing of kvlab above it.

Errors and their one-line form (``errors``), where the shipped files are (``paths``), the run's clock (``clock``),
Ctrl-C and SIGTERM as a way to end a run (``interrupt``), the shared value checks (``checks``), the one table of
figures (``figures``) and the serving timeline's arithmetic (``serving``), the link and decode-check specs
(``link_spec``, ``decode_spec``), the prefill and link rate terms (``rates``, ``sim_terms``), and the request
traces and arrival processes (``traces``, ``arrivals``). No torch.distributed, no process, no config."""
