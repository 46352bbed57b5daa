"""The model and the plan: what a model's cache is and how it is cut between two parallel layouts.

A model's cache components (``spec``, ``kv_dtype``, ``engine_layouts``), a side's split of them
(``parallel``, ``state``), their bytes in memory (``layout``), the transfer plan between two layouts
(``plan``), the chunk schedule of a strategy (``schedule``) and the prefill time model (``prefill``).
Pure functions of their arguments; imports only kvlab.core."""
