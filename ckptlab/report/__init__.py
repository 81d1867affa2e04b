"""What a run shows: analysis of records (Pareto, what fits, summaries), figures and tables."""
