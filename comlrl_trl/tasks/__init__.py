"""Tasks shipped with comlrl_trl: dataset builder, formatters, reward, transition."""
