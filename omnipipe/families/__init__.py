"""omnipipe's own model families, one folder each. Each folder's __init__ defines FAMILY
(omnipipe.api.families.Family) and imports only omnipipe.api; pyproject.toml registers
each through the `omnipipe.families` entry point, as an outside package would."""
