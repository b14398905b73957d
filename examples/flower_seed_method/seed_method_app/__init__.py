"""SuPerFed (or another fedkernels algorithm: `algorithm` in pyproject.toml) as a Flower App."""
