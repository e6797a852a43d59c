"""Runnable examples: ``python -m pagekeeper_client.examples.scheduler`` drives a realistic
load through the client; ``python -m pagekeeper_client.examples.worker`` follows the steps it
publishes and checks the tables with reference paged attention."""
