"""Entry points into other FL frameworks. Each submodule imports its framework only when it is
imported itself, so ``import fedkernels`` never needs them:

- :mod:`fedkernels.integrations.flower`: Flower strategies (``pip install 'fedkernels[flower]'``).
"""
