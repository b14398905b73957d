"""The ClientApp: client `partition-id` of the run, trained by the algorithm's own code."""

from fedkernels.apps.flower import client_app

app = client_app()
