"""The intervention graph: nodes, whitelisted ops, forward-order planning (its wire form
is vinterp.wire.graph)."""
