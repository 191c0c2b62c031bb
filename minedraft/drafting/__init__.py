"""Every proposer and its loading: the draft model's drafter (ordinary or feature-conditioned, EAGLE-style), the
self-drafts (the target's own weights converted), the suffix index and its drafter, the hybrid of both."""
