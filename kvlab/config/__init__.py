"""The one typed config and what is derived from it before any rank starts.

``schema`` composes and validates the Hydra config into a ``Setup`` (one clear line per bad field);
``devices`` places the ranks, ``workload`` turns the workload section into requests, ``faults`` the fault
section into each rank's hooks, ``help`` prints every field with its comment. Imports kvlab.model and
kvlab.core only."""
