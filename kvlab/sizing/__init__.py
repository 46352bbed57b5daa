"""What a run will need and cost, known before it starts: the device memory budget (``budget``),
the cost model's predicted times (``cost``) and the checks that plan every request up front
(``preflight``). May import the transports (to ask for their staging and cost terms) and every layer below them."""
