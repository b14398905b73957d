"""The ServerApp: fedkernels' server half of every round of the configured algorithm."""

from fedkernels.apps.flower import server_app

app = server_app()
