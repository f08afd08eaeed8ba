"""Other trainers fed from a served target: feature-file exporters (speculators, SpecForge) and speculators'
online hidden-states backend. Only `speculators` (the backend) imports a trainer; the exporters need none."""
