"""`python -m eagle3_target.integrations.speculators <speculators train flags>`. The guard matters: spawned
DataLoader workers import the main module again and must not start a second training run."""

from eagle3_target.integrations.speculators import main

if __name__ == "__main__":
    main()
