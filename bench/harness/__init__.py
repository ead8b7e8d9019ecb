"""What every suite shares: the private servers, the contenders' Celery app, the store runs."""
