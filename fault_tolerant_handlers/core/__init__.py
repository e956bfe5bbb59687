"""The core: one fail-together session per process group and everything it stands on (the side
group's agreement, failure records and the store schema, the settings, the release of blocked
collectives, the errors raised). It knows no detector, no launcher and no framework: it never
imports from a sibling folder, and tells them what happens through :mod:`.hooks`."""
