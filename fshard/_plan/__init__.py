"""Layer 2: pure planning. Plans and schedules are functions of global layouts (and a rank), cached."""
