"""Deployment recipes and the cluster in a box (`deploy.local`)."""
