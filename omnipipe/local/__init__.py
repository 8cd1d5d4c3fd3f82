"""`omnipipe serve`: the whole pipeline as local processes, no cluster."""
