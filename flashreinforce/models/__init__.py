"""Models and tokenizers: what the policy is and how its text becomes token ids."""
