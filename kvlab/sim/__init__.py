"""``kvlab sim``: a discrete-event fleet simulator on kvlab's own plan, calibrated by kvlab's measured transfers.

``cluster`` (the instances, GPUs, NVLink domains, links and decode), ``plans`` (each request's bytes and chunks
per rank pair, from kvlab.model.plan and kvlab.model.schedule), ``engine`` (the event loop), ``report`` (its table of
figures), ``run`` (a config to an outcome, the rate search), ``calibrate`` (fitting kvlab.core.sim_terms to runs'
records) and ``cmd`` (the command).
"""
