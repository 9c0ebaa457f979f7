"""Rule-based rewards for RL rollouts (verifiable math answers)."""
