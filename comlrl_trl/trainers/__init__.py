"""Multi-agent trainers. Import them from their family: `comlrl_trl.trainers.reinforce`."""
