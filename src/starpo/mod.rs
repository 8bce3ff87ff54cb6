//! (module under construction; see DESIGN.md)
