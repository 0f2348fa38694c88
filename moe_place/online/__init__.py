"""moe_place.online"""
