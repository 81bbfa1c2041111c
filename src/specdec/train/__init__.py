"""Training drafts for a target: self-distillation data, distilled draft models, EAGLE and Medusa heads."""
