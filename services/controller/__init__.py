"""The controller service: ``service.Controller`` put together from its rooms (see the table
in ``service.py``); ``python -m services.controller`` runs it."""
