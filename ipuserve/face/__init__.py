"""The face of ipuserve: the only place above the components.

The CLI root (:mod:`ipuserve.face.cli`) mounts each component's own commands, the
demo (:mod:`ipuserve.face.demo`) runs them together, and the configuration
reference (:mod:`ipuserve.face.config_reference`) documents every command's
options. These are the modules that import components; the rest of the
``ipuserve`` package -- the common ground: protocol, errors, logs, click helpers,
metrics -- imports none, so every component may import it (DESIGN.md §1).
"""
