"""Eight short, different prompts that engine comparisons share (greedy tokens of each)."""

PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def fibonacci(n):",
    "The three primary colors are",
    "Researchers read the residual stream to",
    "Numbers 0 1 2 3 4 5",
    "A good recipe for bread needs",
    "The capital of Italy is",
]
